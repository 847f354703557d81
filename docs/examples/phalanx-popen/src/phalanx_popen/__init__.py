"""phalanx-popen: a launcher written on phalanx's launcher toolkit."""

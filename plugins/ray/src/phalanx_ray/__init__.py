"""phalanx-ray: run any phalanx strategy on a Ray cluster, one actor per rank."""

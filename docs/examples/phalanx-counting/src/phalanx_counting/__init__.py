"""A phalanx collective that counts every operation and the bytes it moves."""

"""phalanx-compose: collectives composed of other collectives, by name."""

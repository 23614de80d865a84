"""The toy world: coloured shapes on grey, tiny models trained to draw them (committed in data/), and a judge."""

"""Width / depth / loop parametrizations (SP, muP, u-muP, CompleteP) and their optimizer-side rules."""

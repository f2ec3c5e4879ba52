"""The generator ranks of a disaggregated server and rank 0's pool of them."""

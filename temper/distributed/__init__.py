"""Running one job over several processes (torchrun): parallel degrees, FSDP2/TP plans,
sharded-gradient norms, gathering full weights, launching."""

"""torch.distributed.checkpoint storage for ckptfs (being written)."""

"""tierckpt node replicator."""

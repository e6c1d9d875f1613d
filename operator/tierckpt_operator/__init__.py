"""tierckpt Kubernetes operator."""

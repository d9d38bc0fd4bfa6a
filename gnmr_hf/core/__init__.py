"""The pure core: GNMR configuration, controller and trigger policies (PyTorch only, no Hugging Face
imports)."""

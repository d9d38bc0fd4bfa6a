"""Low-cost / recovery path backends, one file each (like ``peft/tuners/lora/bnb.py``)."""

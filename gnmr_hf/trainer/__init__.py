"""The Hugging Face ``Trainer`` integration: the callback and the small parts it delegates to."""

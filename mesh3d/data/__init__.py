"""Data: dummy tokens now; Nanoset and Hugging Face datasets later."""

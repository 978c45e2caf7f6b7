"""The vision-language task (task: vlm): LoRA on a vision-language model\x27s language model, on image + text data."""

"""task=vlm's part of the export layer: the language model's GGUF with llama.cpp's mmproj beside it, and
``generate --image`` (the rules of export/ apply; export reaches them through the vision families and the
registry's generate hook)."""

"""task=vlm's tiny vision-language models and their synthetic task: what ``bench --suite vlm`` trains and the
tests build (the rules of demo/ apply)."""

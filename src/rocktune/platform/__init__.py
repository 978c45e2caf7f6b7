"""What machine is this? Pure data and rules; nothing here imports training code."""

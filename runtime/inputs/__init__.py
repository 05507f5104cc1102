"""What goes into a call: images and videos to pixels, packing into buckets, the tokenizer and chat
template, prompts and prefill payloads."""

"""Tokenizers, torch-free: the byte-level tokenizer of the built-in models (`byte`) and a
Hugging Face directory's own tokenizer (`hf`). The engine (EOS ids, stop strings), the server
(tokenizer ids) and the clients (`get_tokenizer()`) all use them; none of them imports the
engine."""

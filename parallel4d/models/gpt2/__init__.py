"""``model.arch: gpt2``: spec.py (torch-free), model.py (dense GPT), tp2d.py (its 2D twin), family.py."""

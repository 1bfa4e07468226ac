"""``model.arch: llama``: spec.py (torch-free), model.py (dense Llama), tp2d.py (its 2D twin), family.py."""

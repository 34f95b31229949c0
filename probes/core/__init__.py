"""Basics shared by every charllm package; they import nothing else of charllm."""

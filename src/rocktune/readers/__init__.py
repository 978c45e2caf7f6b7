"""Hardened readers for the files rocktune opens from outside (model directories, adapters, run directories,
configs): JSON with a depth bound, YAML without unbounded aliases, safetensors headers checked against the file, and
chat templates rendered in transformers' sandbox. Each turns a hostile or broken file into one ``UserError`` that
names the file, never a traceback, a hang or runaway memory.

A low layer: it imports nothing of rocktune but ``errors``, so every other layer (models/check.py, data, export, report,
train) may use it.
"""

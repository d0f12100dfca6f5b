"""Absolute paths of the jsonl files beside this file, for the task yamls' `data_files: !function
data_files.MC` (lm-eval resolves `!function module.attr` relative to the yaml's folder and returns
the attribute as is, so the tasks load from any checkout location and any working directory)."""

from pathlib import Path

_HERE = Path(__file__).resolve().parent

MC = {"test": str(_HERE / "mc.jsonl")}
GEN = {"test": str(_HERE / "gen.jsonl")}

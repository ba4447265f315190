"""Renderers: JSON, terminal tables and the HTML report. They format; they never analyse."""

from torchscope.report.serialize import to_jsonable, write_json

__all__ = ["to_jsonable", "write_json"]

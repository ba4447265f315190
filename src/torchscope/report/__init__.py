"""Renderers: terminal tables, plots, JSON and the HTML report. They format; they never analyse."""

"""Views: magics, widgets, plots (matplotlib, ipywidgets, IPython)."""

"""The web inspector: trace capture (trace.py), step events (live.py), routes and the static page."""

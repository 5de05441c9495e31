"""``emapg view``: a local, read-only web viewer of training runs, evaluation runs and demo folders.

``runs`` reads the folders (nothing is ever written), ``trajectory`` turns a recorded trajectory into inert
display data (text pieces, never markup), ``server`` is the FastAPI app and the command; ``static/`` holds the
page and its script, and the plotly.js bundle comes from the installed ``plotly`` package (no CDN).
"""

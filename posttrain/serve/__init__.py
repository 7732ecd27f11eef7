"""`posttrain serve`: the explicit API over HTTP with tinker's wire protocol (see app.py)."""

"""Paper-style reports over a sweep: numbers (``summary``), text formats (``render``), plots (``plots``)."""

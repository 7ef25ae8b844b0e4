"""Mechanisms the steps drive: census, quiesce, native checkpoint, CRIU, placement, /proc."""

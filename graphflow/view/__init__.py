"""The view layer: what a person reads. ``units``: bytes and plurals, for every layer.

``render``: plans and reports as text and DOT; ``picture``: the plan's DAG drawn as an
image; ``progress``: a live line per phase and descriptor; ``report``: the phase report
as bars or JSON.
"""

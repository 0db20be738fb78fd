"""The view layer: what a person reads.

``render``: plans and reports as text and DOT; ``picture``: the plan's DAG drawn as an
image; ``progress``: a live line per phase and descriptor; ``report``: the phase report
as bars or JSON. Bytes and plurals, which every layer's messages use, are
``graphflow.units``, in the base.
"""

"""How a segment of a real model is called, and what of the model the engine keeps.

``binding``: the model built and each ``call`` path resolved. ``adopt``: tensors the
model holds made plan buffers. ``calls``: a segment's callable in the model's own
calling convention (inputs by keyword, objects, constants, returns). ``split``: eager
breaks at submodules. ``written``: every declared output really written.
``returned``: outputs kept where the graph returns them. ``reference``: the model's own
forward, verify's independent check. ``compiled``: segments compiled by torch.compile.
``host_state``: plain Python values a step changes, which no graph can see.
"""

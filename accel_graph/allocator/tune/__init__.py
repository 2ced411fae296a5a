"""The allocator-setting search behind ``accel-alloc tune``: the search space and ranking
(``search``) and the advice printed with a recommendation (``advice``)."""

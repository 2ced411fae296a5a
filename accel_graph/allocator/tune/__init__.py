"""The allocator-setting search behind ``accel-alloc tune``: the search (``search``), its space
(``space``), the ranking (``ranking``) and the advice printed with a recommendation
(``advice``)."""

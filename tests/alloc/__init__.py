"""The slot allocator and what it stands on: vattn.allocator, vattn.pages, vattn.cache, the
elastic pool (vattn.pool, vattn.block_books), prefix caching (vattn.prefix_cache), errors."""

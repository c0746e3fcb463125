"""The slot allocator and what it stands on: vattn.allocator, vattn.pages, vattn.cache, the
elastic pool (vattn.pool, vattn.pool.books), prefix caching (vattn.prefix_cache), errors."""

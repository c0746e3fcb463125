"""`vattn bench` (vattn.bench) and the reports it prints (vattn.report)."""

"""One folder per framework: importers (framework -> IR) and emitters (IR -> framework)."""

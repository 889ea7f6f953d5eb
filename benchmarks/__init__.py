"""Config-driven benchmarks (see benchmarks/README.md). Importing this package stays cheap: no JAX, no torch."""

"""Built-in cluster profiles (TOML files read by meshlab.notebook.profiles)."""

"""Built-in cluster profiles (TOML files read by meshlab.profiles)."""

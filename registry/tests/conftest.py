pytest_plugins = ["phalanx_core.testing", "phalanx.testing"]

pytest_plugins = ["tests.support.open_webui"]

pytest_plugins = [
    "tests.support.open_webui",
    "tests.support.browser",
    "tests.support.postgres",
    "tests.support.redis",
]

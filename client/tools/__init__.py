"""The `joader` command's programs: `status`, `top`, `analyze`, `make-demo-data`, `verify` (cli.py,
top.py, analyze.py, which_server.py) and `make demo` (demo.py, demo_data.py). They use the
library (`joader.client`); the library never imports them."""

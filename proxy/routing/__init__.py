"""The proxy's routing layer: which nodes exist and are alive (directory, liveness, dead_nodes), which prefix
blocks they hold (prefix_index), where a request goes (router), and the P/D attempt that runs it there (pd,
attempts, migration) through the nodes' gRPC clients (clients). It knows nothing of HTTP or OpenAI's shapes:
proxy/api/ sits above it and is the only layer that imports it."""

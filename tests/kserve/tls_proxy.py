# SPDX-License-Identifier: MPL-2.0
"""A gRPC TLS front for a plain-text KServe v2 server, for tests/kserve.rs: MLServer serves
gRPC in the clear, so the TLS test puts this in front of it. Every call is passed on as it
came, bytes in and bytes out.

Usage: tls_proxy.py PORT UPSTREAM_PORT CERT KEY"""

import sys
from concurrent import futures

import grpc

port, upstream, cert, key = sys.argv[1:5]
channel = grpc.insecure_channel(f"127.0.0.1:{upstream}")


class Forward(grpc.GenericRpcHandler):
    def service(self, details):
        call = channel.unary_unary(details.method)

        def forward(request, context):
            try:
                return call(request, timeout=30)
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())

        return grpc.unary_unary_rpc_method_handler(forward)


server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
server.add_generic_rpc_handlers((Forward(),))
with open(cert, "rb") as c, open(key, "rb") as k:
    credentials = grpc.ssl_server_credentials([(k.read(), c.read())])
server.add_secure_port(f"127.0.0.1:{port}", credentials)
server.start()
print("ready", flush=True)
server.wait_for_termination()

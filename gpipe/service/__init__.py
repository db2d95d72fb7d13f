"""What the service's processes share and `gpipe.Pipeline` never loads: gRPC, networking for the data
plane's ports, the attempt template (zygote), job records and their protobuf form, code archives."""

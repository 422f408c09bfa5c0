"""An emulated cluster on one machine: hosts as network namespaces with shaped links."""

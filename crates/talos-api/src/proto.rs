//! Code generated from proto/ (the Talos API subset we use), in modules that mirror the protobuf packages
//! so cross-package references resolve.

#![allow(clippy::all, missing_docs, rustdoc::all)]

pub mod google {
    pub mod rpc {
        tonic::include_proto!("google.rpc");
    }
}

pub mod common {
    tonic::include_proto!("common");
}

pub mod machine {
    tonic::include_proto!("machine");
}

pub mod cluster {
    tonic::include_proto!("cluster");
}

pub mod cosi {
    pub mod resource {
        tonic::include_proto!("cosi.resource");
    }
}

pub mod resource {
    pub mod config {
        tonic::include_proto!("resource.config");
    }
}

pub mod talos {
    pub mod resource {
        pub mod definitions {
            pub mod enums {
                tonic::include_proto!("talos.resource.definitions.enums");
            }
            pub mod etcd {
                tonic::include_proto!("talos.resource.definitions.etcd");
            }
            pub mod extensions {
                tonic::include_proto!("talos.resource.definitions.extensions");
            }
            pub mod k8s {
                tonic::include_proto!("talos.resource.definitions.k8s");
            }
            pub mod runtime {
                tonic::include_proto!("talos.resource.definitions.runtime");
            }
            pub mod v1alpha1 {
                tonic::include_proto!("talos.resource.definitions.v1alpha1");
            }
        }
    }
}

//! Recovery: status queries, approvals, human review, audit.

-- Argo CD health check for kvfleet.io/InferenceDeployment (resource.customizations.health).
-- Reads the kstatus conditions the operator writes; an in-progress rollout is Progressing,
-- never Degraded.
local hs = {}
if obj.spec ~= nil and obj.spec.suspend == true then
  hs.status = "Suspended"
  hs.message = "spec.suspend is true"
  return hs
end
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator"
  return hs
end
if obj.status.observedGeneration == nil or obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the latest spec"
  return hs
end
local ready = nil
local stalled = nil
local reconciling = nil
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Ready" then ready = condition end
  if condition.type == "Stalled" then stalled = condition end
  if condition.type == "Reconciling" then reconciling = condition end
end
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = stalled.reason .. ": " .. (stalled.message or "")
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or ""
  return hs
end
hs.status = "Progressing"
if reconciling ~= nil and reconciling.message ~= nil then
  hs.message = reconciling.message
elseif ready ~= nil and ready.message ~= nil then
  hs.message = ready.message
else
  hs.message = "Waiting for replicas"
end
return hs
